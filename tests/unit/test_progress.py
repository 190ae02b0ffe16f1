"""Progress display: a bar on a terminal that log lines never run into, plain log lines
otherwise, nothing on other ranks."""

import io
import logging

import pytest

from pipesgd.observability.progress import LogProgress, NullProgress, ProgressBar, Status, make_progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


STATUS = Status(epoch=2, step=150, total=600, loss=0.4321, iter_ms=20.0, compute_ms=12.0, exposed_comm_ms=1.5)


@pytest.mark.timeout(30)
def test_the_shape_is_chosen_once_by_rank_and_stream(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(make_progress(10, 5, is_main=False, stream=FakeTerminal()), NullProgress)
    assert isinstance(make_progress(10, 5, is_main=True, stream=io.StringIO()), LogProgress)
    bar = make_progress(10, 5, is_main=True, stream=FakeTerminal())
    assert isinstance(bar, ProgressBar)
    bar.close()
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(make_progress(10, 5, is_main=True, stream=FakeTerminal()), LogProgress)


@pytest.mark.timeout(30)
def test_bar_line_fits_the_terminal_and_says_what_matters():
    for columns in (200, 80, 60, 20):
        line = ProgressBar.render(STATUS, columns)
        assert len(line) <= columns - 1
    line = ProgressBar.render(STATUS, 120)
    assert line.startswith("epoch 2 |") and "150/600  25% loss 0.4321 iter 20.0 ms ETA 0m09s" in line
    assert line.count("#") == 10 and line.count("-") == 30


@pytest.mark.timeout(30)
def test_log_lines_erase_the_bar_first():
    term = FakeTerminal()
    handler = logging.StreamHandler(term)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        bar = ProgressBar(600, term, min_interval=0.0)
        bar.show(STATUS)
        logging.getLogger("pipesgd.observability.progress").info("eval after epoch 2")
        out = term.getvalue()
        assert out.index("ETA 0m09s") < out.index("\r\x1b[K" + "eval after epoch 2")
        bar.close()
        assert not handler.filters, "close() removes the filter"
        logging.getLogger("pipesgd.observability.progress").info("after")
        assert term.getvalue().endswith("eval after epoch 2\nafter\n")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.mark.timeout(30)
def test_log_progress_every_n_steps_and_at_the_end(caplog):
    p = LogProgress(total=12, log_every=5)
    assert [s for s in range(1, 13) if p.due(s)] == [5, 10, 12]
    with caplog.at_level(logging.INFO, logger="pipesgd.observability.progress"):
        p.show(STATUS)
    assert caplog.messages == ["epoch 2 step 150/600 loss 0.4321 iter 20.0 ms (compute 12.0, exposed comm 1.5) "
                               "ETA 0m09s"]
