from .language_module import LanguageModule
