from pipesgd_lab.emulate.cli import main

raise SystemExit(main())
