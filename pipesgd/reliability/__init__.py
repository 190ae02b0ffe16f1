"""What keeps a run going and tells why it stopped (docs/reliability.md): checkpoint files
(checkpoint.py) and resuming them on another world size (elastic.py), the replica checks
(replicas.py), hang diagnosis (watchdog.py), stop signals (termination.py), fault injection for
the tests (faults.py), and the trainer's hooks that apply them (hooks.py). Importing this package
imports none of them. A real process-group teardown is pipesgd/teardown.py's, a leaf that comm/ and
hooks/ import before any process group."""
