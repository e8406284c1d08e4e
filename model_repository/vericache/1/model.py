"""Triton Python backend model: translation only. The logic is ``vericache.serving.triton_adapter``."""

import json
import threading
import time

import triton_python_backend_utils as pb_utils

from vericache.serving.triton_adapter import CancelWatcher, GenerationFailed, InvalidInput, TritonAdapter

INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "random_seed", "stop_words",
          "mode", "compressor", "draft_len", "lookup")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.adapter = TritonAdapter.from_parameters(params)
        self.logger = pb_utils.Logger
        # families must outlive their metrics: keep both on the model
        self.requests_family = pb_utils.MetricFamily(name="vericache_triton_requests_total",
                                                     description="Requests by outcome",
                                                     kind=pb_utils.MetricFamily.COUNTER)
        self.ok = self.requests_family.Metric(labels={"outcome": "success"})
        self.bad = self.requests_family.Metric(labels={"outcome": "invalid"})
        self.cancelled = self.requests_family.Metric(labels={"outcome": "cancelled"})
        self.tokens_family = pb_utils.MetricFamily(name="vericache_triton_accepted_tokens_total",
                                                   description="Accepted draft tokens",
                                                   kind=pb_utils.MetricFamily.COUNTER)
        self.accepted = self.tokens_family.Metric(labels={})
        self.kv_family = pb_utils.MetricFamily(name="vericache_triton_kv_cache_bytes",
                                               description="KV bytes held, by tier", kind=pb_utils.MetricFamily.GAUGE)
        self.kv_device = self.kv_family.Metric(labels={"tier": "device"})
        self.kv_host = self.kv_family.Metric(labels={"tier": "host"})
        self.running_family = pb_utils.MetricFamily(name="vericache_triton_num_requests_running",
                                                    description="Requests in the engine",
                                                    kind=pb_utils.MetricFamily.GAUGE)
        self.running = self.running_family.Metric(labels={})
        # one call into Triton at a time: each request is served from its own thread, and concurrent
        # sends and cancellation checks (both go through the stub's interprocess queue) crashed
        # tritonserver (boost::interprocess::lock_exception) when a client died with streams open
        self.ipc = threading.Lock()
        # whether each stream's client is gone, asked from one thread for all (off the response path)
        self.watcher = CancelWatcher(self.adapter.service)
        self.watcher.start()
        threading.Thread(target=self._gauges, daemon=True).start()
        self.logger.log_info(f"vericache model ready: {params}")

    def execute(self, requests):
        # decoupled: each request answers from its own thread. Triton may release a request once
        # execute returns, so its inputs are read here and the threads hold only its response sender
        # (whose is_cancelled() stays valid; the request's own is not)
        for request in requests:
            inputs = {}
            for name in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            threading.Thread(target=self._serve, args=(request.get_response_sender(), inputs), daemon=True).start()
        return None

    def _serve(self, sender, inputs):
        try:
            job = self.adapter.start(inputs)
        except (InvalidInput, ValueError) as exc:
            self._count(self.bad)
            error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
            self._send(sender, pb_utils.InferenceResponse(error=error), final=True)
            return
        finished, gone = False, self.watcher.watch(job, lambda: self._cancelled(sender))
        try:
            for out in self.adapter.responses(job, cancelled=gone.is_set):
                # the engine's last response (it names a finish reason) carries the final flag itself: a
                # client that stops reading at the finish reason leaves nothing open in Triton (a final flag
                # sent alone after it, to a stream the client had cancelled, kept the model from unloading)
                finished = bool(out["finish_reason"][0])
                if finished:
                    # Triton may release the sender once the final flag is sent: no cancellation ask after
                    # it (one asked then crashed tritonserver in TRITONBACKEND_ResponseFactoryIsCancelled)
                    self.watcher.forget(job)
                    self._count(self.ok)   # counted before the client can see the end
                    self._count(self.accepted, int(out["accepted_tokens"][0]))
                response = pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()])
                self._send(sender, response, final=finished)
        except GenerationFailed as exc:
            self.watcher.forget(job)   # before the final flag, as above
            error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INTERNAL)
            self._send(sender, pb_utils.InferenceResponse(error=error), final=True)
            return
        finally:
            self.watcher.forget(job)
        if not finished:   # the client went (the request was aborted): the final flag alone
            self._count(self.cancelled)
            self._send(sender, None, final=True)

    def _count(self, metric, n: int = 1) -> None:
        with self.ipc:   # a metric update goes through the stub's interprocess queue too
            metric.increment(n)

    def _cancelled(self, sender) -> bool:
        with self.ipc:
            return sender.is_cancelled()

    def _send(self, sender, response, final: bool = False) -> None:
        """One response (or only the final flag), serialized with every other call into Triton; a send
        the gone client can no longer take is logged, not raised (the request is ending anyway)."""
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        with self.ipc:
            try:
                if response is None:
                    sender.send(flags=flags)
                else:
                    sender.send(response, flags=flags)
            except Exception as exc:  # noqa: BLE001 - the stream is gone; the engine aborts the job
                self.logger.log_warn(f"vericache: a response could not be sent: {exc}")

    def _gauges(self):
        service = self.adapter.service
        while service.healthy():
            # under the IPC lock like every call into Triton: unserialized, these sets raced the
            # streams' sends and crashed tritonserver when a client died (1 run in ~10 of the kill test)
            with self.ipc:
                gauges = service.gauges()
                self.kv_device.set(gauges["kv_device"])
                self.kv_host.set(gauges["kv_host"])
                self.running.set(service.num_running())
            time.sleep(0.5)   # Prometheus scrapes every few seconds: fewer IPC calls under the lock

    def finalize(self):
        self.watcher.stop()
        self.adapter.service.shutdown(drain_timeout=5)
