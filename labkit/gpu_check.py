"""``python3 -m labkit.gpu_check`` (``make gpu-check``): the GPU node check, :mod:`labkit.course.gpu_check`."""
import sys

from labkit.course.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
