"""`heap.release()` gives freed heap memory back to the OS (glibc), which
the train loop and the benchmark do after initialisation and compilation."""

import platform
import subprocess
import sys
import textwrap

import pytest

from vit_jax import heap

GLIBC = platform.libc_ver()[0] == 'glibc'


@pytest.mark.skipif(not GLIBC, reason='malloc_trim is glibc\'s')
def test_release_returns_freed_heap_memory():
  # A fresh interpreter: 300 MB of small blocks (below malloc's mmap
  # threshold, so from the heap), freed, stay resident until released.
  code = textwrap.dedent('''
      import numpy as np
      from vit_jax import heap
      def rss_mb():
        for line in open('/proc/self/status'):
          if line.startswith('VmRSS'):
            return int(line.split()[1]) // 1024
      blocks = [np.ones(1024) for _ in range(40000)]
      del blocks
      before = rss_mb()
      released = heap.release()
      print(before, rss_mb(), released)
  ''')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True)
  before, after, released = out.stdout.split()
  assert released == 'True'
  assert int(before) - int(after) > 200, out.stdout

