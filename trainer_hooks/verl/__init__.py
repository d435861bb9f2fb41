"""tailspec as a verl rollout backend (``actor_rollout_ref.rollout.name=tailspec``).

``server.py`` serves verl's agent loop from a tailspec engine (nothing there imports verl);
``sampling.py`` maps verl's sampling fields. The verl side (the replica, its server actor and the
trainer-side adapter, registered through the ``verl.plugins`` entry point) needs ``tailspec[verl]``.
"""
