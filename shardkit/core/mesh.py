"""Layout: the sizes of the mesh axes, and the jax Mesh built from them.

Mesh axes are always the canonical six, in this order, size 1 where unused:
``data, fsdp, tensor, sequence, stage, expert``; a user may append axes of their own.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.core.errors import LayoutError, short_repr

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence", "stage", "expert")
_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes of the mesh axes. ``-1`` on one axis means "all devices left over".

    Attributes:
      sizes: ordered ``(axis, size)`` pairs: the canonical axes first, then any custom ones.
      across_hosts: the axes that span hosts (the slower network); every other axis stays
        inside one host. Empty: devices in JAX's order, so the outermost axes span hosts.
      explicit: the mesh axes are ``AxisType.Explicit`` (sharding in types, for models written
        for it); by default they are ``Auto`` (annotations constrain, XLA propagates). One mesh
        has one type: shardkit's own steps do not mix the two.

    Example:
      >>> Layout.parse("data=2,fsdp=-1,tensor=2").resolve(8).spec()
      'data=2,fsdp=2,tensor=2'
    """

    sizes: tuple[tuple[str, int], ...]
    across_hosts: tuple[str, ...] = ()
    explicit: bool = False

    def spanning(self, *axes: str) -> Layout:
        """This layout with ``axes`` spanning hosts, e.g. ``Layout.parse("data=2,fsdp=4").spanning("data")``."""
        unknown = [a for a in axes if a not in self.axis_names]
        if unknown:
            raise LayoutError(f"across_hosts names {unknown[0]!r}, not an axis of {self.spec()}.")
        return dataclasses.replace(self, across_hosts=tuple(a for a in self.axis_names if a in axes))

    @classmethod
    def of(cls, custom: Sequence[str] = (), **sizes: int) -> Layout:
        """Build a layout from keyword sizes: ``Layout.of(data=2, tensor=4)``.

        Axes other than :data:`MESH_AXES` must be declared in ``custom`` (a misspelt axis would
        otherwise shard nothing): ``Layout.of(data=4, replica=2, custom=("replica",))``.
        """
        for name, size in sizes.items():
            if not _AXIS_NAME.match(name):
                raise LayoutError(f"Mesh axis name {name!r} is not an identifier; use e.g. 'data'.")
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise LayoutError(
                    f"Mesh axis {name}={size!r}: a size must be a positive integer, or -1 for "
                    "'the rest of the devices'."
                )
        for name in sizes:
            if name not in MESH_AXES and name not in custom:
                raise LayoutError(_unknown_axis(name, sizes))
        if sum(1 for s in sizes.values() if s == -1) > 1:
            raise LayoutError(
                f"Layout {sizes} has more than one axis of size -1; only one axis can take "
                "'the rest of the devices'. Give explicit sizes to the others."
            )
        custom = [a for a in sizes if a not in MESH_AXES]
        ordered = [(a, sizes.get(a, 1)) for a in MESH_AXES] + [(a, sizes[a]) for a in custom]
        return cls(tuple(ordered))

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``"data=2,fsdp=-1,tensor=2"`` (spaces allowed; unnamed axes have size 1).

        ``across_hosts=data`` (axes joined by ``+``) names the axes that span hosts;
        ``custom=replica`` (joined by ``+``) declares axes of your own. A size may
        carry the axis type, ``fsdp=4:explicit`` (or ``:auto``); the other axes take the same.

        Raises:
          ShardkitError: on a malformed entry, an axis named twice, or axis types that differ.
        """
        if isinstance(text, Layout):
            return text
        sizes: dict[str, int] = {}
        types: dict[str, str] = {}
        across: tuple[str, ...] = ()
        custom: tuple[str, ...] = ()
        if not str(text).strip():
            raise LayoutError("The layout is empty: give mesh axis sizes, e.g. 'data=8' or 'data=2,fsdp=-1,tensor=2'.")
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            name, eq, value = (s.strip() for s in part.partition("="))
            if name in ("across_hosts", "custom"):
                names = tuple(a.strip() for a in value.split("+") if a.strip())
                across, custom = (names, custom) if name == "across_hosts" else (across, names)
                continue
            value, _, axis_type = value.partition(":")
            if axis_type:
                if axis_type.strip() not in ("auto", "explicit"):
                    raise LayoutError(
                        f"Layout entry {part!r}: the axis type after ':' is 'auto' or 'explicit', not {axis_type!r}."
                    )
                types[name] = axis_type.strip()
            try:
                size = int(value)
            except ValueError:
                size = None
            if not eq or size is None:
                raise LayoutError(
                    f"Cannot read layout entry {part!r} in {text!r}: write axis=size, e.g. 'data=2,fsdp=-1,tensor=2'."
                )
            if name in sizes:
                raise LayoutError(f"Layout {text!r} names axis {name!r} twice; name each axis once.")
            sizes[name] = size
        if len(set(types.values())) > 1:
            marked = ", ".join(f"{a}:{t}" for a, t in types.items())
            raise LayoutError(
                f"Layout {text!r} mixes Auto and Explicit mesh axes ({marked}). "
                "shardkit builds one mesh of one axis type: mark every axis ':explicit' for a model written for "
                "sharding in types, or none for Auto axes."
            )
        layout = dataclasses.replace(cls.of(custom, **sizes), explicit="explicit" in types.values())
        return layout.spanning(*across) if across else layout

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.sizes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.sizes)

    def size(self, axis: str) -> int:
        return self.shape.get(axis, 1)

    @property
    def num_devices(self) -> int:
        """Product of the sizes (only meaningful once resolved, i.e. with no -1)."""
        return math.prod(s for _, s in self.sizes)

    def resolve(self, num_devices: int) -> Layout:
        """Replace -1 by the devices left over, and check the product equals ``num_devices``."""
        known = math.prod(s for _, s in self.sizes if s != -1)
        has_rest = any(s == -1 for _, s in self.sizes)
        if has_rest:
            if num_devices % known:
                sizes = ", ".join(str(d) for d in range(1, num_devices + 1) if num_devices % d == 0)
                raise LayoutError(
                    f"Layout {self.spec()} cannot fill {num_devices} device{'s' * (num_devices != 1)}: the fixed "
                    f"axes use {known}, which does not divide {num_devices}. Make their product divide {num_devices} "
                    f"(one of {sizes}), or run on a multiple of {known} devices ({_more_devices(known)})."
                )
            filled = tuple((a, num_devices // known if s == -1 else s) for a, s in self.sizes)
            return dataclasses.replace(self, sizes=filled)
        if known != num_devices:
            raise LayoutError(
                f"Layout {self.spec()} needs {known} devices but {num_devices} are available. "
                f"Make the sizes multiply to {num_devices} (e.g. put -1 on one axis: "
                f"'{_example_fill(self)}'), or run on {known} devices ({_more_devices(known)})."
            )
        return self

    def spec(self) -> str:
        """The layout as a ``--layout`` string, omitting axes of size 1."""
        suffix = ":explicit" if self.explicit else ""
        parts = [f"{a}={s}{suffix}" for a, s in self.sizes if s != 1]
        custom = [a for a in self.axis_names if a not in MESH_AXES]
        if custom:
            parts.append("custom=" + "+".join(custom))
        if self.across_hosts:
            parts.append("across_hosts=" + "+".join(self.across_hosts))
        return ",".join(parts) if parts else f"data=1{suffix}"

    def __str__(self) -> str:
        return self.spec()

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """Build a ``jax.sharding.Mesh`` over ``devices`` (default: all), Auto axes unless the
        layout is explicit.

        Axis order is the layout's order, so the innermost axes (``expert``, ``stage``,
        ``sequence``, ``tensor``) get neighbouring devices.

        Example:
          >>> mesh = Layout.parse("data=2,tensor=4").make_mesh()
          >>> dict(mesh.shape)["tensor"]
          4
        """
        devices = list(jax.devices() if devices is None else devices)
        layout = self.resolve(len(devices))
        shape = tuple(s for _, s in layout.sizes)
        if layout.across_hosts:
            device_array = _hybrid_devices(layout, devices)
        elif devices and devices[0].platform != "cpu":
            # On real hardware let JAX order devices by the physical topology (NVLink, ICI).
            device_array = mesh_utils.create_device_mesh(shape, devices)
        else:
            device_array = np.asarray(devices, dtype=object).reshape(shape)
        axis_type = AxisType.Explicit if layout.explicit else AxisType.Auto
        return Mesh(device_array, layout.axis_names, axis_types=(axis_type,) * len(shape))


# The short names other frameworks use for the same axes.
_ABBREVIATIONS = {
    "dp": "data",
    "tp": "tensor",
    "mp": "tensor",
    "pp": "stage",
    "sp": "sequence",
    "cp": "sequence",
    "ep": "expert",
    "zero": "fsdp",
    "model": "tensor",
    "pipeline": "stage",
    "experts": "expert",
}


def _unknown_axis(name: str, sizes: Mapping[str, int]) -> str:
    """The error for an axis that is neither a mesh axis nor declared, with the likely fix."""
    close = [_ABBREVIATIONS[name.lower()]] if name.lower() in _ABBREVIATIONS else []
    close = close or difflib.get_close_matches(name.lower(), MESH_AXES, n=1, cutoff=0.5)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    entries = ",".join(f"{a}={s}" for a, s in sizes.items())
    return (
        f"Layout axis {name!r} is not a mesh axis ({', '.join(MESH_AXES)}).{guess} An axis of your own must be "
        f"declared, or it would shard nothing: '{entries},custom={name}'."
    )


def _hybrid_devices(layout: Layout, devices: list[jax.Device]) -> np.ndarray:
    """Devices arranged so the ``across_hosts`` axes step between hosts and the others never do."""
    hosts = sorted({d.process_index for d in devices})
    across = math.prod(s for a, s in layout.sizes if a in layout.across_hosts)
    if across != len(hosts):
        raise LayoutError(
            f"Layout {layout.spec()} puts {'x'.join(layout.across_hosts)}={across} across hosts, but the devices "
            f"come from {len(hosts)} host process(es). Make the across-host axes multiply to {len(hosts)}."
        )
    dcn = [s if a in layout.across_hosts else 1 for a, s in layout.sizes]
    ici = [1 if a in layout.across_hosts else s for a, s in layout.sizes]
    per_host = [[d for d in devices if d.process_index == h] for h in hosts]
    if any(len(group) != math.prod(ici) for group in per_host):
        raise LayoutError(
            f"Layout {layout.spec()} keeps {math.prod(ici)} devices inside each host, but the hosts have "
            f"{sorted({len(g) for g in per_host})} devices each."
        )
    # mesh[i] = host block (dcn index) x device within the host (ici index), axis by axis.
    blocks = np.empty(dcn, dtype=object)
    for flat, group in enumerate(per_host):
        blocks[np.unravel_index(flat, dcn)] = np.asarray(group, dtype=object).reshape(ici)
    return np.block(blocks.tolist()) if len(dcn) > 1 else np.concatenate(list(blocks))


def _more_devices(n: int) -> str:
    """How a user gets ``n`` devices: the command line's flag, or the library's call on CPU."""
    return f"--devices {n} on the command line; sk.simulate_devices({n}) in Python, on CPU"


def _example_fill(layout: Layout) -> str:
    sizes = dict(layout.sizes)
    biggest = max(sizes, key=lambda a: sizes[a])
    return ",".join(f"{a}={'-1' if a == biggest else s}" for a, s in sizes.items() if s != 1)


def as_layout(layout: Layout | str | Mapping[str, int]) -> Layout:
    """Accept a Layout, a ``"data=2,..."`` string, or a mapping of sizes."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, str):
        return Layout.parse(layout)
    if isinstance(layout, Mapping):
        return Layout.of(**layout)  # type: ignore[arg-type]  # axis=size keywords
    raise LayoutError(f"Expected a Layout, a string like 'data=2,tensor=4' or a dict; got {short_repr(layout)}.")
