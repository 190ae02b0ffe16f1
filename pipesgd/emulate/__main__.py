from pipesgd.emulate.cli import main

raise SystemExit(main())
