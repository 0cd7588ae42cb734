"""Run by kserve_service_test.py inside its tritonclient venv:

    python kserve_tritonclient_check.py HOST:PORT WORKDIR PROTO_DIR

Calls the gateway the way a Triton user would (tritonclient.grpc.InferenceServerClient), reading
WORKDIR/cases.json and x<i>.npy, writing y<i>.npy (output), ids<i>.npy (expert_ids) and
report.json; the same cases again on one ModelStreamInfer stream (ys<i>.npy), then the statistics,
the model configuration and the repository index into the report. The comparison with moe.v1
Forward is the caller's. Also compares
PROTO_DIR/inference/grpc_service.proto with tritonclient's own descriptors, field for field.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import tritonclient.grpc as triton
from google.protobuf import descriptor_pb2, descriptor_pool
from tritonclient.grpc import model_config_pb2 as triton_config_pb
from tritonclient.grpc import service_pb2 as triton_pb
from tritonclient.utils import InferenceServerException


def proto_fields(descriptor, prefix=""):
    out = {}
    for f in descriptor.fields:
        out[prefix + descriptor.name + "." + f.name] = (f.number, f.type, f.label,
                                                        f.message_type.full_name if f.message_type else None)
    for nested in descriptor.nested_types:
        out.update(proto_fields(nested, prefix + descriptor.name + "."))
    return out


def compare_proto_with_protoc(proto_dir):
    """(fields in ours, fields identical in tritonclient's); every method's types must match."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ours.pb")
        subprocess.run(["protoc", "-I", proto_dir, "--descriptor_set_out=" + out,
                        os.path.join(proto_dir, "inference", "grpc_service.proto")], check=True)
        files = descriptor_pb2.FileDescriptorSet()
        with open(out, "rb") as f:
            files.ParseFromString(f.read())
    pool = descriptor_pool.DescriptorPool()  # not the default pool: tritonclient's holds inference.*
    pool.Add(files.file[0])
    ours = pool.FindFileByName(files.file[0].name)
    total = same = 0
    for name, message in ours.message_types_by_name.items():
        # ModelConfig and its parts live in tritonclient's model_config.proto.
        theirs = proto_fields(triton_pb.DESCRIPTOR.message_types_by_name.get(name) or
                              triton_config_pb.DESCRIPTOR.message_types_by_name[name])
        for key, value in proto_fields(message).items():
            total += 1
            if theirs.get(key) == value:
                same += 1
            else:
                print(f"proto differs from tritonclient's: {key}: ours {value}, theirs {theirs.get(key)}")
    service = triton_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.services_by_name["GRPCInferenceService"].methods:
        theirs = service.methods_by_name[method.name]
        assert theirs.input_type.full_name == method.input_type.full_name, method.name
        assert theirs.output_type.full_name == method.output_type.full_name, method.name
    return total, same


def main():
    target, work, proto_dir = sys.argv[1:4]
    report = {}
    report["proto_fields_ours"], report["proto_fields_compared"] = compare_proto_with_protoc(proto_dir)
    client = triton.InferenceServerClient(target)
    report["live"] = client.is_server_live()
    report["ready"] = client.is_server_ready()
    report["model_ready"] = client.is_model_ready("moe-layer-1")
    report["unknown_model_ready"] = client.is_model_ready("moe-layer-99")
    meta = client.get_model_metadata("moe-layer-1", as_json=True)
    assert meta["name"] == "moe-layer-1" and meta["versions"] == ["1"], meta
    assert [t["name"] for t in meta["outputs"]] == ["output", "expert_ids", "routing_weights"], meta
    with open(os.path.join(work, "cases.json")) as f:
        cases = json.load(f)
    for case in cases:
        i = case["index"]
        x = np.load(os.path.join(work, f"x{i}.npy"))
        datatype = case["datatype"]
        tensor = triton.InferInput("hidden_states", list(x.shape), datatype)
        # BF16 takes float32 values (tritonclient keeps their high 16 bits).
        tensor.set_data_from_numpy(x.astype(np.float16) if datatype == "FP16" else x)
        outputs = [triton.InferRequestedOutput("output"), triton.InferRequestedOutput("expert_ids")]
        result = client.infer(case["model"], [tensor], outputs=outputs, request_id=f"case-{i}")
        assert result.get_response().id == f"case-{i}"
        assert result.get_output("output").datatype == datatype, result.get_output("output")
        np.save(os.path.join(work, f"y{i}.npy"), result.as_numpy("output"))
        np.save(os.path.join(work, f"ids{i}.npy"), result.as_numpy("expert_ids"))
    # The same requests on one stream, answered in order; one bad request in the middle gets its
    # error on the stream and the stream goes on.
    import queue
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for case in cases:
        i = case["index"]
        x = np.load(os.path.join(work, f"x{i}.npy"))
        tensor = triton.InferInput("hidden_states", list(x.shape), case["datatype"])
        tensor.set_data_from_numpy(x.astype(np.float16) if case["datatype"] == "FP16" else x)
        client.async_stream_infer(case["model"], [tensor], request_id=f"stream-{i}",
                                  outputs=[triton.InferRequestedOutput("output")])
        if i == 0:
            bad = triton.InferInput("hidden_states", [1, 4], "FP32")
            bad.set_data_from_numpy(np.ones((1, 4), np.float32))
            client.async_stream_infer("moe-layer-99", [bad], request_id="stream-bad")
    stream_errors = []
    for _ in range(len(cases) + 1):
        result, error = answers.get(timeout=60)
        if error is not None:
            stream_errors.append(str(error))
            continue
        i = int(result.get_response().id.split("-")[1])
        np.save(os.path.join(work, f"ys{i}.npy"), result.as_numpy("output"))
    client.stop_stream()
    report["stream_errors"] = stream_errors
    config = client.get_model_config("moe-layer-1", as_json=True)["config"]
    report["config"] = {"name": config["name"], "max_batch_size": config.get("max_batch_size", 0),
                        "inputs": [(t["name"], t["data_type"], t["dims"]) for t in config["input"]],
                        "outputs": [t["name"] for t in config["output"]]}
    stats = client.get_inference_statistics(as_json=True)["model_stats"]
    report["stats"] = {m["name"]: {"inference_count": int(m.get("inference_count", 0)),
                                   "execution_count": int(m.get("execution_count", 0)),
                                   "success": int(m["inference_stats"]["success"].get("count", 0)),
                                   "success_ns": int(m["inference_stats"]["success"].get("ns", 0)),
                                   "queue_ns": int(m["inference_stats"]["queue"].get("ns", 0)),
                                   "compute_ns": int(m["inference_stats"]["compute_infer"].get("ns", 0)),
                                   "fail": int(m["inference_stats"]["fail"].get("count", 0))}
                       for m in stats}
    index = client.get_model_repository_index(as_json=True)["models"]
    report["index"] = sorted((m["name"], m.get("version"), m.get("state")) for m in index)
    report["extensions"] = client.get_server_metadata(as_json=True).get("extensions", [])
    try:
        tensor = triton.InferInput("hidden_states", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        client.infer("moe-layer-99", [tensor])
        report["unknown_model_infer_status"] = "OK"
    except InferenceServerException as e:
        report["unknown_model_infer_status"] = e.status()
    client.close()
    with open(os.path.join(work, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
