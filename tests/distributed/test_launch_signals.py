"""``pipesgd.launch.run`` starts its workers through torch's elastic agent, which installs handlers for
SIGTERM, SIGINT, SIGHUP and SIGQUIT in the calling process and leaves them there. A training loop that
called it must get its own handlers back: afterwards Ctrl-C is the caller's again."""

import os
import signal

import pytest

from pipesgd import launch


def _mine(signum, frame):  # pragma: no cover - never delivered
    raise AssertionError("not called")


@pytest.mark.timeout(120)
def test_the_callers_signal_handlers_are_restored_after_a_launch():
    saved = {sig: signal.getsignal(sig) for sig in launch._AGENT_SIGNALS}
    try:
        for sig in launch._AGENT_SIGNALS:
            signal.signal(sig, _mine)
        launch.run(os.getpid, (), nproc=1)
        changed = [signal.Signals(s).name for s in launch._AGENT_SIGNALS if signal.getsignal(s) is not _mine]
        assert changed == [], f"the launch left its own handler for {changed}"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
