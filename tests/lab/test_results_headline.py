"""The committed headline results are what the report composes from the committed records: the
command in a results folder's README, rerun, rewrites that folder's JSON exactly but for the
report's own ``commit`` and ``date``. A record moved, dropped or edited by hand fails here, and so
does a README whose command no longer reproduces its result."""

import json
import re
import shlex

import pytest
from runs import ROOT

from pipesgd_lab.bench import tta

HEADLINES = [("time-to-accuracy", "time-to-accuracy.json"), ("gpt-shakespeare", "time-to-target-gpt_shakespeare.json")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("folder, name", HEADLINES)
def test_the_report_recomposes_the_committed_result_from_its_records(folder, name, tmp_path, monkeypatch):
    readme = (ROOT / "results" / folder / "README.md").read_text()
    command = re.search(r"```bash\n(python -m pipesgd_lab\.bench\.tta .*?)```", readme, re.S).group(1)
    argv = shlex.split(command.replace("\\\n", " "))[3:]
    assert "--phase" in argv and argv[argv.index("--phase") + 1] == "report", command
    monkeypatch.chdir(ROOT)  # the command's paths are a clone's root's
    out = tmp_path / name
    assert tta.main([*argv, "--dir", str(tmp_path / "dir"), "--json", str(out), "--plot", ""]) == 0
    fresh, committed = json.loads(out.read_text()), json.loads((ROOT / "results" / folder / name).read_text())
    for key in ("commit", "date"):  # the report stamps its own
        fresh.pop(key), committed.pop(key)
    assert fresh == committed
