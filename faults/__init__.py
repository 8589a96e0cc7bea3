"""Fault injection declared in `[[faults]]`: the supervisor's one way in.

The supervisor imports only the names below (`from faults import X`), never a module of the
package, and only for a config that declares faults:
- loading the config: `parse_all` the tables into `FaultSpec`s, checked against `shape_of` it;
- once the job's nodes are resolved: `check_world` (every target exists), and
  `partition_problem` (a partition needs the test bed's hosts);
- running the job: a `FaultEngine`, handed what it needs of the supervisor (its control
  channel, its host name, its event log; its rank table on every call: `faults.protocols`).

faults/ imports only `contracts` (and the standard library).
"""

from faults.engine import FaultEngine
from faults.partition import problem as partition_problem
from faults.spec import FaultSpec, check_world, parse_all, shape_of

__all__ = ["FaultEngine", "FaultSpec", "check_world", "parse_all", "partition_problem", "shape_of"]
