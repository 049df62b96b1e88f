"""One session across a process group: FSDP2 sharding and the batch split (``sharding``), the
ranks in lockstep, and a sharded session's checkpoints and weights in and out."""
