"""What keeps a run going and tells why it stopped (docs/reliability.md): checkpoint files
(checkpoint.py) and resuming them on another world size (elastic.py), the replica checks
(replicas.py), hang diagnosis (watchdog.py), stop signals (termination.py), a real process-group
teardown (teardown.py), fault injection for the tests (faults.py), and the trainer's hooks that
apply them (hooks.py). Importing this package imports none of them: comm/ imports teardown.py
before any process group, long before the hooks' imports of the engine and the trainer."""
