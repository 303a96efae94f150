"""Invariance probes (docs/spec.md section 7): how a deployment convinces itself that detcomm keeps its contract.

    python -m detcomm.probe collectives   every declared site reduced in many batch compositions
    python -m detcomm.probe model         a small tensor-parallel transformer, alone vs packed vs rerun
    python -m detcomm.probe tp-compare    the same requests' token ids and logprob bits at different TP widths
    python -m detcomm.probe align         a trainer's teacher-forced logprobs vs a server's sampling-time ones
    python -m detcomm.probe rows          the row counts at which an op's row 0 changes bits (docs/spec.md §7 (row-count mapper))

collectives and model run on every rank of a group (start them with detcomm-launch, torchrun or mpiexec);
rank 0 prints the table. Each exits non-zero when something that claims bitwise invariance changed.
"""
