from ling_watchdog.cli import main

raise SystemExit(main())
