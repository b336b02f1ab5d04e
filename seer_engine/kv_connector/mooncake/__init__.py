"""``mooncake``: the KV block pool in a Mooncake store, shared by engines on one or many hosts.

``master.py`` runs and supervises a ``mooncake_master`` (and a process holding the pool's
memory) for a pool that names no master; ``store.py`` is the ``BlockStore`` client every
process opens on the pool. ``factory.make_kv_pool`` wires them to a ``PooledConnector``.
"""

from seer_engine.kv_connector.mooncake.master import MooncakeMaster, find_binary
from seer_engine.kv_connector.mooncake.store import MooncakeSpec, MooncakeStore

__all__ = ["MooncakeMaster", "MooncakeSpec", "MooncakeStore", "find_binary"]
