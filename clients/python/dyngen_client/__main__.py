"""`python -m dyngen_client`: the same as the `dyngen-client` command."""

import sys

from dyngen_client.cli import main

sys.exit(main())
