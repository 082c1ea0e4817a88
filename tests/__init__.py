import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, wherever a test file sits
