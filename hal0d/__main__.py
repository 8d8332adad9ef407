from hal0d.cli import main

raise SystemExit(main())
