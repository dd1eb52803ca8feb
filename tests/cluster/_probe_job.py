"""Run as a Ray job by tests/cluster/test_submit.py: joins the cluster and prints one `PROBE {json}` line.

The driver's ray.init sets GSPO_PROBE=driver while the job was submitted with GSPO_PROBE=job: this is the clash
gspo-ray's own driver meets (its ray.init adds env_vars), resolved by RAY_OVERRIDE_JOB_RUNTIME_ENV=1.
"""
import json
import os
import shutil
import sys

import ray


@ray.remote(num_cpus=1, resources={"rollout_node": 1})
def where() -> dict:
    import gspo_ray

    return {"node": ray.get_runtime_context().get_node_id(), "env": os.environ.get("GSPO_PROBE"),
            "gspo_ray": gspo_ray.__file__}


if __name__ == "__main__":
    ray.init(runtime_env={"env_vars": {"GSPO_PROBE": "driver"}})
    out = {"resources": ray.cluster_resources(), "alive": sum(n["Alive"] for n in ray.nodes()),
           "driver_node": ray.get_runtime_context().get_node_id(), "python": sys.executable,
           "gspo_ray_exe": shutil.which("gspo-ray"), "task": ray.get(where.remote())}
    print("PROBE " + json.dumps(out), flush=True)
