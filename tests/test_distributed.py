import socket

from tailspec.distributed import free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
