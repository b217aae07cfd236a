"""What the compiler did, and what it should cost: the HLO reader, the report (collectives by
mesh axis and op, memory per device, FLOPs, the layout's lower bound), hardware profiles, the
analytic estimate and the extrapolation of dry runs past the CPU compiler's reach.

May import: ``core``, ``runtime``, ``io``, ``parallel``, ``models``.
"""
