"""The actor systems' contract (``tailspec.actors``), the same for Ray and for threads: values
are copied across, a reference argument arrives as its value, errors and deaths are reported as
the module's exceptions, streams end, and a killed actor answers nothing."""

import sys
import threading
import time

import pytest

from tailspec.actors import ActorDied, CallFailed, WaitTimeout, actors_for


class Box:
    """A test actor: holds a list, can block until released, can fail."""

    def __init__(self, items, fail=False):
        if fail:
            raise ValueError("no box today")
        self.items = items
        self.gate = threading.Event()

    def grow(self, item):
        self.items.append(item)
        return self.items

    def mutate(self, given):
        given.append("mutated")
        return len(given)

    def blocked(self):
        self.gate.wait(30)
        return "released"

    def open_gate(self):
        self.gate.set()

    def fail(self):
        raise KeyError("inside")

    def count(self, n):
        for i in range(n):  # noqa: UP028 - Ray's streaming call fails on a method that delegates with yield from
            yield i

    def count_then_fail(self):
        yield 0
        raise KeyError("mid-stream")

    def ask(self, actors, other, item):
        return actors.get(actors.call(other, "grow", item))


@pytest.fixture(params=["threads", "ray"])
def actors(request):
    if request.param == "ray":
        request.getfixturevalue("ray_local")
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests
    return actors_for(request.param)


def spawn(actors, *args, **kwargs):
    return actors.spawn(Box, *args, **kwargs, num_cpus=0, num_gpus=0, max_concurrency=4)


def test_values_cross_as_copies_and_references_arrive_as_values(actors):
    items = [1]
    box = spawn(actors, items)
    assert actors.get(actors.call(box, "grow", 2)) == [1, 2]
    assert items == [1]  # the actor's list is its own copy

    given = ["a"]
    assert actors.get(actors.call(box, "mutate", given)) == 2
    assert given == ["a"]

    snapshot = ["x"]
    ref = actors.put(snapshot)
    snapshot.append("later")
    assert actors.get(actors.call(box, "mutate", ref)) == 2  # the put value, as its own copy
    assert actors.get(ref) == ["x"]

    other = spawn(actors, [])
    assert actors.get(actors.call(box, "ask", actors, other, "via a handle")) == ["via a handle"]
    actors.kill(box)
    actors.kill(other)


def test_a_call_that_raises_fails_with_its_cause_and_the_actor_lives_on(actors):
    box = spawn(actors, [])
    with pytest.raises(CallFailed, match="inside"):
        actors.get(actors.call(box, "fail"))
    assert actors.get(actors.call(box, "grow", 1)) == [1]
    actors.kill(box)


def test_a_constructor_that_raises_leaves_an_actor_whose_calls_fail(actors):
    box = spawn(actors, [], True)
    with pytest.raises(ActorDied, match="no box today"):
        actors.get(actors.call(box, "grow", 1), timeout=60)


def test_streams_give_their_items_in_order_then_end(actors):
    box = spawn(actors, [])
    stream = actors.stream(box, "count", 3)
    got = []
    while True:
        ready, _ = actors.wait([stream], num_returns=1, timeout=60)
        assert ready == [stream]
        try:
            got.append(actors.get(next(stream)))
        except StopIteration:
            break
    assert got == [0, 1, 2]

    failing = actors.stream(box, "count_then_fail")
    assert actors.get(next(failing)) == 0
    with pytest.raises(CallFailed, match="mid-stream"):
        actors.get(next(failing))
    actors.kill(box)


def test_wait_returns_what_is_ready_and_get_times_out(actors):
    box = spawn(actors, [])
    blocked, quick = actors.call(box, "blocked"), actors.call(box, "grow", 1)
    ready, waiting = actors.wait([blocked, quick], num_returns=1, timeout=60)
    assert ready == [quick] and waiting == [blocked]
    ready, waiting = actors.wait([blocked], num_returns=1, timeout=0.2)
    assert ready == [] and waiting == [blocked]
    with pytest.raises(WaitTimeout):
        actors.get(blocked, timeout=0.2)
    actors.get(actors.call(box, "open_gate"))
    assert actors.get(blocked, timeout=60) == "released"
    actors.kill(box)


def test_a_killed_actor_fails_its_open_and_later_calls(actors):
    box = spawn(actors, [])
    actors.get(actors.call(box, "grow", 1))  # started
    blocked = actors.call(box, "blocked")
    stream = actors.stream(box, "count", 10**9)
    actors.get(next(stream))
    time.sleep(0.2)
    actors.kill(box)
    with pytest.raises(ActorDied):
        actors.get(blocked, timeout=60)
    with pytest.raises(ActorDied):
        while True:
            actors.get(next(stream), timeout=60)
    with pytest.raises(ActorDied):
        actors.get(actors.call(box, "grow", 2), timeout=60)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        actors_for("mpi")
