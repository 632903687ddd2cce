"""The Ray Serve application: replicas that each own one engine process, one OpenAI API."""
