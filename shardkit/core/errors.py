"""The exceptions shardkit raises for bad input: one base, :class:`ShardkitError`, and a small
family under it, one per part of the library a fix lives in. Every message shows the values and
names the fix; ``docs/errors.md`` is generated from these docstrings and the raise sites
(``python -m shardkit.cli.error_sites > docs/errors.md``).

Catch ``sk.ShardkitError`` for all of them (it is a ``ValueError``, so code written for plain
``ValueError`` keeps working), or one subclass for one kind.
"""


class ShardkitError(ValueError):
    """Bad input to shardkit. The message says what is wrong, shows the values, names the fix."""


class InputError(ShardkitError):
    """A setting, flag, config file, batch or dataset that cannot be used as given: a number out
    of range, an unknown choice, a batch of the wrong shape or dtype, token ids past the
    vocabulary, a file that is missing or unreadable. Fix: the value the message names."""


class LayoutError(ShardkitError):
    """A layout that cannot be laid over the devices: a malformed ``axis=size`` string, sizes
    whose product is not the device count, a batch or dimension that does not divide its mesh
    axes (parameters, activations and batches alike), mixed mesh axis types. Fix: other sizes,
    another layout, ``allow_replicate=True``, or more simulated devices."""


class RuleError(ShardkitError):
    """Rules from logical names (or parameter-path regexes) to mesh axes that cannot be applied:
    a name without a rule, a mesh axis used twice, a regex that does not compile or misses a
    parameter. Fix: add or change the rule the message shows."""


class AnnotationError(ShardkitError):
    """Sharding names or a ``PartitionSpec`` that do not fit the array they annotate: the wrong
    number of names or entries for its shape. Fix: one name (or None) per dimension, in
    ``sk.annotate``, the model's metadata or the ``sk.constrain`` call."""


class ModelError(ShardkitError):
    """A model, model factory or optimizer that shardkit cannot train: a Flax module not wrapped
    by ``sk.from_nnx``/``sk.from_linen``, an unknown preset, a factory that cannot be imported, an
    optimizer that is not optax. Fix: wrap, rename or import as the message shows."""


class PipelineError(ShardkitError):
    """A pipeline (``stage`` axis) that cannot be built: layers or microbatches that do not split
    over the stages, an unknown schedule. Fix: stage count, microbatches or schedule."""


class CheckpointError(ShardkitError):
    """A checkpoint directory or run directory that cannot be saved to or resumed from: not
    writable, no room, locked by another run, written by a different run or model. Fix: another
    directory, ``--allow-change``, ``--overwrite`` or the setting the message names."""


class ClusterError(ShardkitError):
    """A multi-process job that cannot start or went wrong: launcher arguments, the coordinator,
    a worker that failed or stopped answering. Fix: the launcher flags or the failed process's
    log, as the message says."""


class AnalysisError(ShardkitError):
    """A compiled program that the report cannot read (an HLO text format it does not
    recognise), so it refuses to guess. Fix: report it with the jax version; pin a tested one."""


FAMILY: tuple[type[ShardkitError], ...] = (
    InputError,
    LayoutError,
    RuleError,
    AnnotationError,
    ModelError,
    PipelineError,
    CheckpointError,
    ClusterError,
    AnalysisError,
)


def short_repr(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never prints a whole model.

    Example:
      >>> short_repr(list(range(100)), limit=20)
      '[0, 1, 2, 3, 4, 5, 6… (a list)'
    """
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… (a {type(value).__name__})"
