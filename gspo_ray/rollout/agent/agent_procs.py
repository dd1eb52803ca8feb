"""Where agents run: killable child processes of the rollout worker, many episodes at once in each (asyncio).

    procs = AgentProcs("my_pkg.agents:solve", {"max_calls": 2}, num_procs=2, events=endpoint.requests)
    procs.start_episode(child_index, episode_id, url, key, task, timeout_s)    # procs.serial(child_index): its id
    # events: ("agent_started" | "agent_done", episode_id[, value]) | ("agent_error", episode_id, reason)
    #         | ("agent_proc_dead", child serial, why)
    procs.cancel(child_serial, episode_id, why)     # one episode's task cancelled: it reports agent_error(why)
    procs.kill(child_serial, why); procs.close()

Each child (`child_procs.spawn_child`, niced, dies with its parent) imports the agent once and runs every episode
it is given as an asyncio task: `await asyncio.wait_for(fn(client, task, **kwargs), timeout_s)` with
`client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)` (timeout_s None: no wall clock here, the
parent ends the episode with `cancel`: partial rollouts hold a call across rounds). An exception or a timeout ends only that
episode (reported with the exception's type, message and raising frame). An agent that blocks its event loop
cannot be timed out from inside: the parent kills the process past the deadline, which ends its other episodes
too (`agent_proc_dead`).
"""
from __future__ import annotations

import itertools
import pickle
import queue
import threading
from typing import Any

from gspo_ray.rollout.child_procs import child_env, end_children, enter_child, kill_child, spawn_child


class _Child:
    _serials = itertools.count()  # a replaced child's late events are told apart from its successor's

    def __init__(self, index: int, init: tuple, events: queue.Queue):
        self.index, self.events, self.serial = index, events, next(self._serials)
        self.popen, self.send, self.recv = spawn_child("gspo_ray.rollout.agent.agent_procs:child_main", child_env())
        self.send.send(init)
        self.dead: str | None = None
        self.killed_why: str | None = None
        threading.Thread(target=self._read, name="agent-proc-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.recv.recv()
            except (EOFError, OSError):
                self.dead = self.killed_why or f"agent process died (exit code {self.popen.poll()})"
                self.events.put(("agent_proc_dead", self.serial, self.dead))
                self.recv.close()
                return
            if msg[0] == "init_error":
                self.dead = msg[1]
                self.events.put(("agent_proc_dead", self.serial, msg[1]))
            elif msg[0] in ("agent_started", "agent_done", "agent_error"):
                self.events.put(msg)


class AgentProcs:
    """`num_procs` children running the agent `fn` (import path) with `kwargs`; results go to `events`."""

    def __init__(self, fn: str, kwargs: dict[str, Any], num_procs: int, events: queue.Queue):
        self._init = (fn, dict(kwargs))
        self.events = events
        self.killed = 0  # children killed for a blocked episode, all time
        self.children = [_Child(i, self._init, events) for i in range(num_procs)]

    def replace_dead(self) -> None:
        """A fresh child in place of each dead one (call between batches: a dead child hosts no live episode)."""
        for i, c in enumerate(self.children):
            if c.dead is not None or c.popen.poll() is not None:
                if c.popen.poll() is None:
                    kill_child(c.popen, c.send)
                self.children[i] = _Child(i, self._init, self.events)

    def serial(self, index: int) -> int:
        """The serial of the child now at `index` (what its `agent_proc_dead` event carries)."""
        return self.children[index].serial

    def start_episode(self, index: int, episode_id: str, url: str, key: str, task: dict,
                      timeout_s: float | None) -> None:
        """timeout_s: the episode's wall clock inside its process (None: none; the caller ends it, `cancel`)."""
        child = self.children[index]
        try:
            child.send.send(("run", episode_id, url, key, task, timeout_s))
        except (OSError, ValueError) as e:
            self.events.put(("agent_error", episode_id, f"agent process unreachable: {e}"))

    def cancel(self, serial: int, episode_id: str, why: str) -> None:
        """Stop one episode's agent (its asyncio task is cancelled); it reports `agent_error` with `why`."""
        c = next((c for c in self.children if c.serial == serial), None)
        if c is not None and c.dead is None:
            try:
                c.send.send(("cancel", episode_id, why))
            except (OSError, ValueError):
                pass  # a dead process: its reader reports it

    def kill(self, serial: int, why: str) -> None:
        """Kill a child whose episode blocked it; its reader then reports `agent_proc_dead` with `why`."""
        c = next((c for c in self.children if c.serial == serial), None)
        if c is not None and c.dead is None and c.popen.poll() is None:
            c.killed_why = why
            self.killed += 1
            kill_child(c.popen, c.send)

    @property
    def pids(self) -> list[int]:
        return [c.popen.pid for c in self.children]

    def close(self) -> None:
        end_children([(c.popen, c.send) for c in self.children])
        self.children = []


# ---- the child side -------------------------------------------------------------------------------------------
def child_main(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Run episodes as they arrive, each an asyncio task, until the parent's pipe closes."""
    import asyncio

    recv, send = enter_child(read_fd, write_fd, parent_pid)
    fn_path, kwargs = recv.recv()
    try:
        import openai

        from gspo_ray.rollout.agent.protocol import load_agent

        fn = load_agent(fn_path)
    except BaseException as e:  # reported once; the parent ends this child's episodes with it
        send.send(("init_error", f"the agent failed to load in its process: {type(e).__name__}: {e}"))
        return
    loop = asyncio.new_event_loop()
    lock = threading.Lock()  # the reader thread and the loop both write to the pipe

    def reply(msg: tuple) -> None:
        try:
            data = pickle.dumps(msg)
        except Exception as e:  # an unpicklable return value
            data = pickle.dumps(("agent_error", msg[1], f"the agent returned an unpicklable value: {e}"))
        with lock:
            send.send_bytes(data)

    async def episode(episode_id: str, url: str, key: str, task: dict, timeout_s: float | None) -> None:
        from gspo_ray.envs.plugins import raise_site

        reply(("agent_started", episode_id))  # the episode's wall clock starts now (not while the child loads)
        client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout_s)
        try:
            value = await asyncio.wait_for(fn(client, task, **kwargs), timeout_s)
        except asyncio.TimeoutError:
            reply(("agent_error", episode_id, f"agent timed out after {timeout_s:g}s"))
        except asyncio.CancelledError:  # the parent's `cancel`
            reply(("agent_error", episode_id, cancelled.pop(episode_id, "agent cancelled")))
        except BaseException as e:  # the agent may raise anything; it ends only its episode
            site = raise_site(e)
            reply(("agent_error", episode_id, f"agent raised {type(e).__name__}"
                   f"{' at ' + site if site else ''}: {str(e)[:500]}"))
        else:
            reply(("agent_done", episode_id, value))
        finally:
            try:
                await client.close()
            except Exception:
                pass

    tasks: dict = {}  # episode id -> its task (asyncio keeps only weak references to running tasks)
    cancelled: dict = {}  # episode id -> why the parent cancelled it

    def launch(msg: tuple) -> None:
        if msg[0] == "cancel":
            task = tasks.get(msg[1])
            if task is not None:
                cancelled[msg[1]] = msg[2]
                task.cancel()
            return
        task = loop.create_task(episode(*msg[1:]))
        tasks[msg[1]] = task
        task.add_done_callback(lambda _, eid=msg[1]: tasks.pop(eid, None))

    def read() -> None:
        while True:
            try:
                msg = recv.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(loop.stop)
                return
            loop.call_soon_threadsafe(launch, msg)

    threading.Thread(target=read, name="agent-child-reader", daemon=True).start()
    loop.run_forever()
