import sys

from services.studio.server import main

sys.exit(main(sys.argv[1:], prog="python -m services.studio"))
