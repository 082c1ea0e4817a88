"""Interactive client of tools/run_text_generation_server.py (Megatron's tools/text_generation_cli.py).

    python tools/text_generation_cli.py localhost:5000
"""
import json
import sys
import urllib.error
import urllib.request


def generate(url: str, prompt: str, tokens_to_generate: int, **options) -> dict:
    """PUT one prompt to ``http://URL/api``; returns the JSON answer (raises ValueError with the server's reason)."""
    data = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate, **options}).encode()
    req = urllib.request.Request(f"http://{url}/api", data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"Error {e.code}: {json.loads(e.read()).get('message')}") from None


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/text_generation_cli.py HOST:PORT")
    url = sys.argv[1]
    while True:
        try:
            prompt = input("Enter prompt: ")
            tokens = int(input("Enter number of tokens to generate: "))
        except (EOFError, KeyboardInterrupt):
            return
        except ValueError:
            print("the number of tokens must be an integer")
            continue
        try:
            print("Megatron Response: ")
            print(generate(url, prompt, tokens)["text"][0])
        except ValueError as e:
            print(e)


if __name__ == "__main__":
    main()
