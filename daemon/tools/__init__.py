"""Tool calls, structured output and reasoning, on the server side: what the request asks for (spec), how a model
family writes calls (families, parsers), the grammars that enforce them (grammar), and the plan that puts it
together for one model (plan). Pure text and JSON: no HTTP, no tensors."""
