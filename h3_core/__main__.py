import signal
import sys

try:
    from .app.cli import main

    code = main()
except KeyboardInterrupt:
    # A Ctrl-C while torch imports, or in the last instructions of main after its result or its message was printed:
    # exit as interrupted, without a traceback. `main` itself reports every interrupt that reaches its work.
    code = 130
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process is exiting: nothing is left to interrupt
sys.exit(code)
