"""A process group that outlives a lost replica: a quorum kept in a store, a new group per membership.

A collective whose peer died raises on gloo at once (a closed connection); the group is then
useless. The survivors destroy it and form the next *generation*: each announces itself in a
``TCPStore`` that none of the workers hosts (the :class:`Lighthouse`, torchft's name for it). Every
worker beats a heartbeat into the store from a thread of its own; the membership closes when every
expected member has either arrived or gone quiet for ``stale_s`` (a survivor still blocked in the
dead group's collective keeps beating, and is waited for until its collective times out), with one
``compare_set`` (the first writer wins, so all read the same list), and the members call
``init_process_group`` again over that generation's ``PrefixStore``. A heartbeat carries its
process's *incarnation* (a token of its own): torchrun's replacement beats under the same replica
id within a second of the kill, and without the token it would keep the dead member looking alive
until the quorum's timeout (seen here: 120 s of two survivors waiting for a member that was dead).
A replaced worker (torchrun restarts it), or a survivor left out because its beat came late,
announces that it wants to join; at each step boundary the members agree, by one broadcast from
their rank 0, whether to let it in, and all of them form the next generation together. Members
keep their order by replica id, so a whole group has the ranks it started with.

This is torchft's design (a lighthouse, heartbeats, a quorum per step, reconfigurable process
groups) in its simplest form: the heartbeats compare one host's clock (torchft's lighthouse times
them itself), one lighthouse, gloo only (NCCL communicators need an abort to be re-created, which
torchft wraps; see the chapter).
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time

import torch
import torch.distributed as dist

from labkit.core.checks import non_negative_int, positive_int, positive_number


class Lighthouse:
    """The store the workers meet in, hosted by the process that starts them (it outlives them) on a
    port the OS picks."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=positive_number("timeout_s", timeout_s)))
        self.port = self.store.port


class Quorum:
    """One worker's view of the membership: :meth:`form`, :meth:`joiners`, :meth:`grow`, :meth:`join`.

    ``timeout_s`` bounds a store operation and a whole quorum; ``collective_s`` a collective of the
    group (after which a survivor stuck in a dead group's collective raises and comes to regroup)."""

    def __init__(self, port: int, replica: int, replicas: int, timeout_s: float = 60.0, collective_s: float = 10.0,
                 stale_s: float = 0.5, host: str = "127.0.0.1") -> None:
        self.replica, self.replicas = non_negative_int("replica", replica), positive_int("replicas", replicas)
        self.timeout = datetime.timedelta(seconds=positive_number("timeout_s", timeout_s))
        self.collective = datetime.timedelta(seconds=positive_number("collective_s", collective_s))
        self.stale_s = positive_number("stale_s", stale_s)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self.gen, self.members, self.incarnations = -1, [], {}
        self.token = f"{os.getpid()}.{time.time_ns()}"  # this process: a replacement has another
        self.quiet_until = 0.0
        beat = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)  # its own connection
        threading.Thread(target=self._beat, args=(beat,), daemon=True, name="labkit-heartbeat").start()

    def _beat(self, store: dist.TCPStore) -> None:
        while True:  # until the process ends: a dead worker's beat stops with it
            if time.monotonic() >= self.quiet_until:
                store.set(f"hb/{self.replica}", f"{time.time()!r} {self.token}")
            time.sleep(self.stale_s / 5)

    def stall(self, seconds: float) -> None:
        """A planted fault: this worker stops, heartbeat and all, for ``seconds`` (a process the OS did
        not schedule, a long pause of the host), as a starved survivor's beat once went late."""
        self.quiet_until = time.monotonic() + positive_number("seconds", seconds)
        time.sleep(seconds)

    def alive(self, replica: int) -> bool:
        """Whether ``replica`` beat within ``stale_s`` (one host's clock: the workers share it), as
        the process that was a member of this worker's generation (not a replacement of it)."""
        if not self.store.check([f"hb/{replica}"]):
            return False
        at, token = self.store.get(f"hb/{replica}").decode().split()
        if token != self.incarnations.get(replica, token):
            return False
        return time.time() - float(at) < self.stale_s

    @property
    def rank(self) -> int:
        return self.members.index(self.replica)

    def form(self, gen: int, expected: list[int], everyone: bool = True) -> list[int] | None:
        """Enter generation ``gen`` expecting ``expected``: every one of them (``everyone``), or, after
        a failure, those still beating. Then the membership is closed and the group made. None when
        it closed without this worker."""
        s = self.store
        s.set(f"g{gen}/in/{self.replica}", self.token)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not s.check([f"g{gen}/members"]) and time.monotonic() < deadline:
            missing = [r for r in expected if not s.check([f"g{gen}/in/{r}"])]
            if not [r for r in missing if everyone or self.alive(r)]:
                break
            time.sleep(0.005)
        present = [r for r in expected if s.check([f"g{gen}/in/{r}"])]
        members = json.loads(s.compare_set(f"g{gen}/members", "", json.dumps(present)))
        if self.replica not in members:
            return None
        self.gen, self.members = gen, members
        self.incarnations = {r: s.get(f"g{gen}/in/{r}").decode() for r in members}
        dist.init_process_group("gloo", store=dist.PrefixStore(f"g{gen}/pg", s), rank=self.rank,
                                world_size=len(members), timeout=self.collective)
        return members

    def leave(self) -> None:
        """Drop this generation's group (after a failure, or to form the next one)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def joiners(self) -> list[int]:
        """Replaced workers waiting to join, as the members' rank 0 sees them; a collective, so every
        member gets the same answer."""
        flags = torch.zeros(self.replicas, dtype=torch.int32)
        if self.rank == 0:
            for r in set(range(self.replicas)) - set(self.members):
                flags[r] = int(self.store.check([f"join/{r}"]))
        dist.broadcast(flags, src=0)
        return [r for r in range(self.replicas) if flags[r]]

    def grow(self, joiners: list[int]) -> list[int]:
        """Let ``joiners`` in: the members' rank 0 invites them, every member forms the next generation."""
        expected = sorted(self.members + joiners)
        gen = self.gen + 1
        if self.rank == 0:
            self.store.set(f"g{gen}/expected", json.dumps(expected))
            for r in joiners:
                self.store.delete_key(f"join/{r}")
                self.store.set(f"invite/{r}", str(gen))
        self.leave()
        return self._must_form(gen, expected)

    def join(self) -> list[int]:
        """A replaced worker: ask to join, wait for the invitation, form the generation it names."""
        self.store.set(f"join/{self.replica}", "1")
        gen = int(self.store.get(f"invite/{self.replica}"))  # blocks until invited (or the store's timeout)
        self.store.delete_key(f"invite/{self.replica}")
        return self._must_form(gen, json.loads(self.store.get(f"g{gen}/expected")))

    def _must_form(self, gen: int, expected: list[int]) -> list[int]:
        members = self.form(gen, expected)
        if members is None:
            raise RuntimeError(f"replica {self.replica} was left out of generation {gen} ({expected} expected)")
        return members
