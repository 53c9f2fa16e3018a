"""Stand-in for PuLP on the lent GPU machine (scripts/gpu/wheelhouse.py, STUBBED).

modelopt/torch/opt/searcher.py imports pulp at module level and names its classes in annotations
(``list[pulp.LpVariable]``), which run at import; it solves with them only during an architecture
search, which `porting` never starts. The real PuLP is 15.6 MiB, a quarter of what may travel, so
this package takes the import: the names modelopt uses exist, and using any of them fails.
"""

__version__ = "3.3.2+stub"

_WHY = (
    "PuLP is a stand-in carried to the GPU machine by porting's scripts/gpu/wheelhouse.py; "
    "modelopt's search is not available there"
)


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_WHY)


# Every name modelopt 0.37 reads from pulp (grep 'pulp\.' modelopt/).
LpProblem = LpVariable = PULP_CBC_CMD = _Unavailable
LpMinimize, LpMaximize = 1, -1
LpBinary = "Binary"
LpStatus: dict = {}


def __getattr__(name: str):
    raise AttributeError(f"pulp.{name}: {_WHY}")
