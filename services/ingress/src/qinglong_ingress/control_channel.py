"""The internal channel to control, renewed when ingress's client certificate is.

A channel's credentials are fixed when it is made, and ingress's client certificate is
replaced in place as it is renewed (cert-manager: 90-day certificates, renewed 30 days
early). Connections already open keep their TLS session, but every new one — a control
pod restarted, a connection that died — would present the old certificate, and once it
expires control refuses the handshake: every forwarded call fails. So the files are
looked at every :data:`CHECK_SECONDS`; when they changed, a new channel is made, the
gateways switch to it for their next call, and the old one is closed once the calls in
flight on it can have ended (:data:`RETIRE_SECONDS`, beyond the longest forwarded call).
The servers' own certificates are taken up at each new handshake instead
(:func:`qinglong_protocol.tls.mutual_tls_server_credentials`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final, Protocol

import grpc
from qinglong_protocol.tls import TlsFilesWatch

from qinglong_ingress.gateway import MAX_FORWARD_SECONDS
from qinglong_ingress.server import open_control_channel
from qinglong_ingress.settings import ControlChannelSettings

_log = logging.getLogger(__name__)

#: How often the client certificate's files are looked at (a stat of three files).
CHECK_SECONDS: Final = 60.0
#: How long a replaced channel stays open for the calls already on it.
RETIRE_SECONDS: Final = MAX_FORWARD_SECONDS + 10.0
#: How long a new channel may take to connect before it is given up (and tried again at
#: the next look): one that cannot reach control is never switched to.
READY_SECONDS: Final = 10.0


class ChannelUser(Protocol):
    def use_runtime(self, channel: grpc.aio.Channel) -> None: ...


class RenewingControlChannel:
    def __init__(self, settings: ControlChannelSettings) -> None:
        self._settings = settings
        self._watch = TlsFilesWatch(settings.tls)
        self.current = open_control_channel(settings, self._watch.read())
        self._users: list[ChannelUser] = []
        self._retired: list[tuple[grpc.aio.Channel, float]] = []

    def serve(self, user: ChannelUser) -> None:
        """``user`` (a gateway made with :attr:`current`) switches with every renewal."""
        self._users.append(user)

    async def renew_if_changed(self) -> bool:
        """Switch to a new channel if the certificate files changed; close the channels
        retired long enough ago. True if it switched."""
        await self._close_retired(asyncio.get_running_loop().time())
        if not self._watch.changed():
            return False
        try:
            fresh = open_control_channel(self._settings, self._watch.read())
        except OSError as error:  # mid-rotation: the next look
            _log.warning("ingress's client certificate not read: %s", error.strerror)
            self._watch.forget()
            return False
        # Files read in the middle of a rotation (a certificate with the old key) make a
        # channel whose every handshake fails: it is never switched to.
        if not await _connects(fresh, READY_SECONDS):
            await fresh.close()
            self._watch.forget()
            _log.warning(
                "ingress's renewed client certificate could not reach control; the current"
                " channel stays, and the files are looked at again"
            )
            return False
        for user in self._users:
            user.use_runtime(fresh)
        retire_at = asyncio.get_running_loop().time() + RETIRE_SECONDS
        self._retired.append((self.current, retire_at))
        self.current = fresh
        _log.info("ingress's client certificate changed: calls to control use a new channel")
        return True

    async def run(self, check_seconds: float = CHECK_SECONDS) -> None:
        """Renew for as long as ingress serves (cancelled at shutdown)."""
        while True:
            await asyncio.sleep(check_seconds)
            try:
                await self.renew_if_changed()
            except Exception:  # a fault of its own must not end the renewing for good
                _log.exception("renewing the channel to control failed; looked at again later")

    async def close(self) -> None:
        for channel, _ in self._retired:
            with contextlib.suppress(Exception):
                await channel.close()
        self._retired.clear()
        await self.current.close()

    async def _close_retired(self, now: float) -> None:
        for channel, at in list(self._retired):
            if at <= now:
                with contextlib.suppress(Exception):
                    await channel.close()
                self._retired.remove((channel, at))  # closed (a cancel before: close() will)


async def _connects(channel: grpc.aio.Channel, seconds: float) -> bool:
    """The channel connects within ``seconds``; False at its first failure (a refused
    handshake is not waited out)."""

    async def ready() -> bool:
        state = channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                return False
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
        return True

    try:
        return await asyncio.wait_for(ready(), seconds)
    except TimeoutError:
        return False
