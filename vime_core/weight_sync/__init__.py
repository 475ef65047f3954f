"""Weight sync: the trainer's HF-named weights into running vLLM engines (publish.py drives a publish;
transport/ holds the transports picked by placement). The formats both ends share are in wire/, and
the engine side's receivers in vime_core/engines/vllm_side/. Nothing is imported here: wire/ must stay
importable in the vLLM environment, which has neither the trainer's packages nor Prefect."""
