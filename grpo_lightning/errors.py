"""The faults a user can fix, and how the command line ends on each: one line, ``error: ...``, and an exit status.

Every such fault raises a ``UserFacingError``; ``grpo_lightning.cli.main`` prints its message as one line (never a
traceback; ``GRPO_DEBUG=1`` shows it) and exits with the class's ``exit_code``:

- 2, ``ConfigError``: a setting, data file, model/teacher/dataset path or reward function that cannot work;
- 3, ``ServiceError``: a service the run talks to is down, does not answer or refuses: a vLLM server, a served
  teacher, an OpenEnv server at ``url``;
- 4, ``EnvironmentCrashed``: an environment or tool failed: a server the run started exited, the environment raised
  on its server, a tool or its sandbox is broken, a replayed trajectory answered differently;
- 1, ``NonFiniteError``: ``model.max_nonfinite_skips`` optimizer steps in a row had a NaN/Inf loss or gradient.

A run stopped by SIGTERM exits with 0 after saving its checkpoint. The module imports nothing of the package, so
that any module may raise these.
"""

from __future__ import annotations


class UserFacingError(Exception):
    """A fault the user can fix; its message is one line that names the setting, service or environment at fault.

    ``exit_code``: the exit status of ``python -m grpo_lightning`` when it stops the run (2 unless a subclass says
    otherwise: bad settings or data).
    """

    exit_code: int = 2


class ConfigError(UserFacingError, ValueError):
    """A setting has a value that cannot work. The message names the setting and the fix."""

    exit_code = 2


class ServiceError(UserFacingError, RuntimeError):
    """A service the run talks to cannot be used: down, silent past its time limit, dead mid-run, or refusing. The
    message names it (its URL) and the setting that points at it."""

    exit_code = 3


class EnvironmentCrashed(UserFacingError, RuntimeError):
    """An environment or a tool failed, not the policy's action: a server the run started exited, the environment
    raised on its server, a tool (or its sandbox) is broken. The message names it."""

    exit_code = 4


class NonFiniteError(UserFacingError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient. The message names the culprit."""

    exit_code = 1


EXIT_CODES = {cls.__name__: cls.exit_code for cls in (ConfigError, ServiceError, EnvironmentCrashed, NonFiniteError)}
"""Each class's exit status, by name (docs/checkpoints.md's table is checked against it)."""
