"""The protocol version nodes and coordinator compare in the Register handshake."""

# Bump on any change that an older peer would misread; the proto package name (geotrain.v1) changes only when
# the wire format breaks wholesale.
PROTOCOL_VERSION = 18
# 18: the coordinator starts a step with the apply of the one before (StepDriver.run_step), so a stage may receive
#    the next step's activations before the order to apply: a node of 17 would compute them with the parameters of
#    the step before, silently; a node of 18 keeps them until it has applied, and the fused AdamW it steps with
#    rounds otherwise than 17's per-tensor loop (replicas of both would disagree)
# 17: a raw state stream's TensorHeader carries no crc32 (0) and its receiver checks none (statestream.py); a header's
#    crc32 of 0 is not checksummed (framing.StateReceiver): a coordinator of 16 would refuse a holder of 17's state
#    as corrupt, and every checkpoint with it
# 16: a raw tensor stream's TensorHeader carries no crc32 (0) and its receiver checks none (tensorstream.py): a
#    plaintext receiver of 15 would refuse every tensor of a sender of 16 as corrupt; Stage.OpenStateStream (a
#    node of 15 answers UNIMPLEMENTED, and is fetched from by FetchState as before); a verifier takes its checks
#    from ApplyStep.checks (CheckDraw.verifier, .order) and reports them with its next GradNorm
#    (GradNormRequest.reports; Coordinator.Verified is gone): a node of 15 would verify nothing
# 15: a stage's checksum is blake3, not sha256 (framing.parameters_checksum): an older node's would differ from
#    its replicas' and from every checkpoint's; ApplyStep.checks: a node of 14 keeps no evidence of drawn
#    microbatches, so every check of it would go unserved
# 14: GradNormRequest.forward_s_per_microbatch (a node of 13 leaves it 0: its compute would read as all backward)
# 13: a stage's checksum (StepApplied, LoadState.expected_checksum) is over its parameters in name order
#    (framing.parameters_checksum): an older node's would differ from its replicas' and from every checkpoint's
# 12: RunConfig.transport (which a node requires), Stage.OpenTensorStream and the raw tensor stream it opens
# 11: RunConfig.compression.replica_sync (a node that ignored "diloco" would wait in gradient all-reduces its peers
#    never start), HeartbeatRequest.averaging_bytes_sent
# 10: relays: Plan.relays, Stage.Relay, ReverseDown.origin and signature (a node that ignored them would stall)
# 9: ModelSettings.boundary_rank (a node that ignored it would build another model than its neighbours)
# 8: Plan.inflight: the plan's in-flight window (a node that ignored it would keep train.inflight's, 0 under auto)
# 7: Plan.coordinator_key: a node serves its state only to the plan's nodes and the coordinator, by their signatures
# 6: reachability: RegisterReply.reachability, StageAssignment.unreachable, Stage.Reverse streams, UploadState
# 5: node identity: RegisterRequest.public_key and a signature on every call (an unsigned node is refused),
#    StageAssignment.public_keys
# 3: StageAssignment.hierarchical_allreduce (a node that ignored it would wait in groups its peers never form)
# 2: node profiles (RunConfig.profile, which a node requires; ReportProfile, Probe)
