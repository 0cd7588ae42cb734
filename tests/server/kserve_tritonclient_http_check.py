"""Run by kserve_rest_test.py inside its tritonclient venv:

    python kserve_tritonclient_http_check.py HOST:PORT WORKDIR TOKEN

Calls the gateway's REST API the way a Triton user would (tritonclient.http), reading
WORKDIR/cases.json and x<i>.npy (binary or JSON inputs as each case says), writing y<i>.npy
(output), ids<i>.npy (expert_ids) and report.json with health, the statistics, the model
configuration, the repository index and the status of a call without the token. The comparison
with moe.v1 Forward is the caller's.
"""

import json
import os
import sys

import numpy as np
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException


def main():
    url, work, token = sys.argv[1], sys.argv[2], sys.argv[3]
    client = triton.InferenceServerClient(url)

    def auth():  # tritonclient adds its own headers to the dict it is given: a fresh one each call
        return {"Authorization": f"Bearer {token}"}

    report = {"live": client.is_server_live(), "ready": client.is_server_ready(),
              "model_ready": client.is_model_ready("moe-layer-1"),
              "unknown_model_ready": client.is_model_ready("moe-layer-99")}
    try:
        client.get_server_metadata()
        report["unauthenticated"] = 200
    except InferenceServerException as e:
        report["unauthenticated"] = int(e.status())
    with open(os.path.join(work, "cases.json")) as f:
        cases = json.load(f)
    for case in cases:
        i = case["index"]
        x = np.load(os.path.join(work, f"x{i}.npy"))
        tensor = triton.InferInput("hidden_states", list(x.shape), case["datatype"])
        if case["datatype"] == "FP16":
            x = x.astype(np.float16)
        tensor.set_data_from_numpy(x, binary_data=case["binary"])  # BF16: float32 truncated to bf16
        outputs = [triton.InferRequestedOutput("output", binary_data=case["binary"]),
                   triton.InferRequestedOutput("expert_ids", binary_data=not case["binary"])]
        result = client.infer(case["model"], [tensor], outputs=outputs, headers=auth(), request_id=f"h{i}")
        if result.get_response()["id"] != f"h{i}":
            raise AssertionError(result.get_response())
        y = result.as_numpy("output")
        np.save(os.path.join(work, f"y{i}.npy"), np.asarray(y, np.float32))
        np.save(os.path.join(work, f"ids{i}.npy"), result.as_numpy("expert_ids"))
    report["config"] = client.get_model_config("moe-layer-1", headers=auth())
    report["index"] = [[m["name"], m["version"], m["state"]]
                       for m in client.get_model_repository_index(headers=auth())]
    report["stats"] = {}
    for model in ("moe-layer-1", "moe-layer-2"):
        stats = client.get_inference_statistics(model, headers=auth())["model_stats"][0]
        s = stats["inference_stats"]
        report["stats"][model] = {"inference_count": stats["inference_count"],
                                  "success_ns": s["success"]["ns"], "queue_ns": s["queue"]["ns"],
                                  "compute_ns": s["compute_infer"]["ns"]}
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
