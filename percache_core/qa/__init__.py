"""The QA bank: past and predicted questions with answers, the verifier of drafts, what
binds an answer to the pipeline that produced it, and answers kept per exact prompt."""
