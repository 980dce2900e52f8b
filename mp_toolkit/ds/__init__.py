"""DeepSpeed: its JSON config read into typed settings and merged under the CLI's flags, and
``--engine deepspeed`` (DeepSpeed's PipelineEngine behind `mp_toolkit.engine.interface.TrainEngine`).
Only `pipe` imports DeepSpeed itself."""
