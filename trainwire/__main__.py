from trainwire.cli import main

raise SystemExit(main())
