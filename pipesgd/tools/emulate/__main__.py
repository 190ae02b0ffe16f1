from pipesgd.tools.emulate.cli import main

raise SystemExit(main())
