"""The engine's host side: backends, the paged KV cache, sampling, sessions.

Importing it points numba's compile cache at the user cache dir (core.paths.use_numba_cache) before
anything below imports numba, so that a script or library that imports core.engine compiles into
the same cache as the CLI. numba's default cache sits beside the sources and checks only the time
stamp of the file that defines a function, while a caller's cached code holds its callees': after
an edit of a kernel's file, its callers would keep running the old kernel.
"""
from core.paths import use_numba_cache

use_numba_cache()
