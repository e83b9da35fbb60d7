"""The ``hpu-fp8`` command line: the click group, its error mapping and the commands in pipeline order."""
