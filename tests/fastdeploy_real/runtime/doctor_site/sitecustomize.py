"""On PYTHONPATH for `hpu-fp8 doctor` runs only: doctor runs paddle and FastDeploy in a child interpreter, which
needs the same CPU stand-ins (fd_bootstrap) as the process that started it; Python imports this file at start-up."""

import fd_bootstrap  # noqa: F401
