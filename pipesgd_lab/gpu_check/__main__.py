"""``python -m pipesgd_lab.gpu_check``: the whole GPU check (:mod:`pipesgd_lab.gpu_check.runner`)."""

from .runner import main

raise SystemExit(main())
