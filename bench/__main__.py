from ling_bench.bench import main

raise SystemExit(main())
