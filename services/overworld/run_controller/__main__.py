import sys

from overworld.run_controller.operator import main

sys.exit(main())
