"""DeepSpeed: its JSON config read into typed settings and merged under the CLI's flags, and
``--engine deepspeed`` (DeepSpeed's PipelineEngine behind the calls `mpt train`'s loop makes).
Only `pipe` imports DeepSpeed itself."""
