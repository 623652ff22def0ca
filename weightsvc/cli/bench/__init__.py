"""`weightsvc bench`: the performance figures as ratios against a baseline measured in the same run.

One module per figure or family of figures, each starting the servers it measures as processes of
their own (`weightsvc.cli._server`), as in production:
- transfer: T1 pull, T2 push, T3 fan-out, M1 peak RSS, P1 the clients' pull (nginx for reference)
- sync: E1 sync time to N watching pullers, S1 per-tensor cost
- memory: S2 anonymous RSS with --data-dir
- loop: L1, the longest block of the event loop in each of the above
- scale: scale_3v1, pullers from 3 sharded replicas (on Redis) vs from 1
- kernels, delta, sass: K1/K2, delta sizes, K3_sass instruction counts; gpu: the CUDA machine's
- store: the object store's bytes per version, upload and pull against its raw PUT and GET
- fabric: N1, a pull over NIXL against a bare NIXL READ of the same bytes; N2, four readers of a
  quarter of the rows each against bare READs; N3, the control plane's cost per version
- publish: PUB1, a publish until four readers hold their slices against bare READs from the learner's
  ranks; PUB2, the bytes a learner's publish moves per version against an fp32 push's (bf16, fp8)
- rawtcp: the baselines (a ratio of 1.0 means "as fast as the socket"); peers: the puller processes
- run: the chosen parts, as one dict; soak: the long run of `--soak`
"""

# Which part of the bench measures each figure id (`--only` takes ids or part names). Here, where
# `weightsvc bench` checks `--only` before it loads the parts; this package imports none of its
# modules itself, so the peers run as `python -m` of theirs.
PARTS = {"T1": "transfer", "T2": "transfer", "T3": "transfer", "M1": "transfer", "K1": "kernels", "K2": "kernels",
         "delta": "delta", "scale_3v1": "scale", "E1": "E1", "S1": "S1", "S2": "S2", "P1": "P1",
         "K3_sass": "sass", "store": "store", "N1": "N1", "N2": "N2", "N3": "N3",
         "PUB1": "PUB1", "PUB2": "PUB2"}
