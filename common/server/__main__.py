import sys

from common.server.launch import main

sys.exit(main())
