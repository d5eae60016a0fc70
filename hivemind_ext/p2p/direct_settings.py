"""What a component's ``direct_data_path`` / ``direct_plaintext`` keywords mean, as configs.

Why: the averager (and through ``averager_opts`` the Optimizer) takes the direct path's settings
as two keywords; this turns them, once, into the server's :class:`DirectConfig` (whose address may
only be known once the peer's daemon runs, see :mod:`~hivemind_ext.p2p.direct_address`) and the
caller's :class:`DirectClientConfig`, so every component reads them the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hivemind_ext.errors import ConfigurationError
from hivemind_ext.p2p.direct_address import direct_config_for
from hivemind_ext.p2p.direct_client import DirectClientConfig
from hivemind_ext.p2p.direct_server import DirectConfig


@dataclasses.dataclass(frozen=True)
class DirectSettings:
    """The direct path of one component: off, on at an automatic address, or on with a given config.

    :param enabled: dial peers directly (and serve, unless in client mode)
    :param server: the server's settings; None with ``enabled``: choose the address at start
    :param plaintext: serve plain TCP and use plaintext servers (an explicit opt-in)
    """

    enabled: bool
    server: DirectConfig | None = None
    plaintext: bool = False

    @classmethod
    def of(cls, direct_data_path: bool | str | DirectConfig | None, *, plaintext: bool = False) -> DirectSettings:
        """From the keywords: ``True`` (automatic address), an IP address string (a wildcard such as
        ``"0.0.0.0"`` means ``True``), a DirectConfig, or ``False`` / ``None`` (off); ``plaintext``
        opts into plain TCP."""
        if not isinstance(plaintext, bool):
            raise ConfigurationError(f"direct_plaintext must be a bool, got {plaintext!r}")
        if direct_data_path is None or direct_data_path is False:
            return cls(enabled=False)
        if direct_data_path is True:
            return cls(enabled=True, plaintext=plaintext)
        if direct_data_path in ("0.0.0.0", "::"):  # every interface: the offered address is chosen at start
            return cls(enabled=True, plaintext=plaintext)
        if isinstance(direct_data_path, str):
            server = DirectConfig(host=direct_data_path, plaintext=plaintext)
            return cls(enabled=True, server=server, plaintext=plaintext)
        if isinstance(direct_data_path, DirectConfig):
            plaintext = plaintext or direct_data_path.plaintext
            return cls(enabled=True, server=_with_plaintext(direct_data_path, plaintext), plaintext=plaintext)
        raise ConfigurationError(
            f"direct_data_path must be True, False, None, an IP address or a DirectConfig, got {direct_data_path!r}"
        )

    @property
    def client_config(self) -> DirectClientConfig:
        return DirectClientConfig(allow_plaintext=self.plaintext)

    async def server_config(self, dht: Any, p2p: Any) -> DirectConfig | None:
        """The server's settings, with the address chosen now if it was automatic; None when off
        or when this peer has no address to offer."""
        if not self.enabled:
            return None
        if self.server is not None:
            return self.server
        base = DirectConfig(host="127.0.0.1", plaintext=self.plaintext)  # its address is replaced
        return await direct_config_for(dht, p2p, base)


def _with_plaintext(config: DirectConfig, plaintext: bool) -> DirectConfig:
    return dataclasses.replace(config, plaintext=True) if plaintext and not config.plaintext else config
