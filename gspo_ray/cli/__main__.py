"""`python -m gspo_ray.cli ...` is `gspo-ray ...`."""
import sys

from gspo_ray.cli.main import main

sys.exit(main())
