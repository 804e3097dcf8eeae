"""Process exit codes of the kvtrace CLI. spec/cli.md is the normative table (with the --json /
--json-out convention); the README repeats it. Change all three together."""

OK = 0
INVALID = 1  # a trace that breaks the spec (validate lists every problem)
UNREADABLE = 2  # not a kvtrace trace, not HDF5, truncated, unreadable
FINDINGS = 3  # analyze --fail-on: a finding reached the threshold
VERSION = 4  # written by a newer kvtrace: a trace format, what-if / analysis JSON schema or fleet schema major version
USAGE = 64  # bad command-line arguments (EX_USAGE)
UNAVAILABLE = 69  # a needed component is absent: torch, a GPU, triton (EX_UNAVAILABLE)
INTERNAL = 70  # a bug in kvtrace (EX_SOFTWARE); rerun with KVTRACE_DEBUG=1 for a traceback
CANNOT_WRITE = 73  # output path not writable (EX_CANTCREAT)
IO_ERROR = 74  # record: generation finished but the trace stopped early on a storage failure (EX_IOERR)
REFUSED = 77  # privacy: traces hold prompt text or tensor contents; pass --allow-content (EX_NOPERM)
INTERRUPTED = 130  # Ctrl-C
BROKEN_PIPE = 141  # stdout closed by its reader (`| head`): quiet, no message (128 + SIGPIPE)
